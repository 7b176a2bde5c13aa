for i in $(seq 1 37); do echo "row $((i * 7 % 11))"; done > data.txt
