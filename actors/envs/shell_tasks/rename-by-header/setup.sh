mkdir inbox
names="alpha bravo charlie delta echo foxtrot golf hotel india juliet"
i=1
for n in $names; do printf 'name: %s\nbody of item %d\n' "$n" "$i" > "inbox/item-$i"; i=$((i + 1)); done
