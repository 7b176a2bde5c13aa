mkdir stores
for s in $(seq 1 9); do
  for item in apple bread cheese dates eggs; do
    [ $(((s + ${#item}) % 3)) = 0 ] && continue
    echo "$item $(((s * ${#item}) % 9 + 1))"
  done > "stores/store-$s.txt"
done
