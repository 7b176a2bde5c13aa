mkdir sales
for i in $(seq 1 8); do
  f="sales/region-$i.csv"
  if [ $((i % 2)) = 0 ]; then echo "id,amount,item" > "$f"; else echo "item,id,amount" > "$f"; fi
  for j in 1 2 3; do
    a=$(((i * 11 + j * 7) % 40 + 1))
    if [ $((i % 2)) = 0 ]; then echo "$j,$a,thing$j" >> "$f"; else echo "thing$j,$j,$a" >> "$f"; fi
  done
done
