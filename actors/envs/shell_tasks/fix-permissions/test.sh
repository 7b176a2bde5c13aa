for i in $(seq 1 10); do
  if grep -qx "tool-$i" manifest.txt; then [ -x "tools/tool-$i" ] || exit 1
  else [ ! -x "tools/tool-$i" ] || exit 1; fi
done
