s=0; for i in $(seq 1 8); do for j in 1 2 3; do s=$((s + (i * 11 + j * 7) % 40 + 1)); done; done
[ "$(tr -d ' \n' < total.txt)" = "$s" ]
