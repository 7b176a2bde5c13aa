for n in alpha bravo charlie delta echo foxtrot golf hotel india juliet; do
  [ -f "inbox/$n.txt" ] && head -1 "inbox/$n.txt" | grep -qx "name: $n" || exit 1
done
[ "$(ls inbox | wc -l)" = "10" ]
