set -- red:blue cat:dog sun:moon one:two hot:cold up:down fast:slow old:new
i=1
for pair in "$@"; do
  o=${pair%%:*}; n=${pair##*:}
  [ "$(cat "src/part-$i.txt")" = "$(printf 'the %s value\nkeep %s here\nplain line' "$n" "$n")" ] || exit 1
  i=$((i + 1))
done
