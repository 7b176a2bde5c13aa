expected=0
for i in $(seq 1 12); do expected=$((expected + i * 17 % 50 + 5)); done
[ "$(tr -d ' \n' < total.txt)" = "$expected" ]
