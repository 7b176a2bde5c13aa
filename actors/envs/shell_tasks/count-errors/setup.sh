mkdir logs
for i in $(seq 1 10); do
  f=$(printf 'logs/service-%02d.log' "$i")
  for j in $(seq 1 12); do
    if [ $(((i + j) % 5)) = 0 ]; then echo "line $j ERROR failed"; else echo "line $j INFO ok"; fi
  done > "$f"
done
