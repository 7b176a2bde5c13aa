words="pla net ary orb its cal mly and qui etly"
k=1
for w in $words; do
  d="vault/zone-$((k % 3))/shelf-$((k * 7 % 5))"
  mkdir -p "$d"
  printf 'noise line\nfragment %d of 10: %s\nmore noise\n' "$k" "$w" > "$d/box-$((k * 13 % 17)).txt"
  k=$((k + 1))
done
for j in 1 2 3; do mkdir -p "vault/zone-$j"; echo "nothing here" > "vault/zone-$j/empty-$j.txt"; done
