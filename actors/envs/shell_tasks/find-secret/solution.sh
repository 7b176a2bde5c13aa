grep -l secret notes/*.txt
basename "$(grep -l secret notes/*.txt)" > answer.txt
