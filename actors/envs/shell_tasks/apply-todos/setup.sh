mkdir src
set -- red:blue cat:dog sun:moon one:two hot:cold up:down fast:slow old:new
i=1
for pair in "$@"; do
  o=${pair%%:*}; n=${pair##*:}
  printf 'TODO: replace %s with %s\nthe %s value\nkeep %s here\nplain line\n' "$o" "$n" "$o" "$o" > "src/part-$i.txt"
  i=$((i + 1))
done
