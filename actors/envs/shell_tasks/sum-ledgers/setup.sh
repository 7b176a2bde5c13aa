mkdir ledgers
for i in $(seq 1 12); do
  f=$(printf 'ledgers/ledger-%02d.txt' "$i")
  { echo "ledger $i"; echo "entries: $((i * 3))"; echo "total: $((i * 17 % 50 + 5))"; echo "checked: yes"; } > "$f"
done
