expected=$(for i in $(seq 1 10); do n=0; for j in $(seq 1 12); do [ $(((i + j) % 5)) = 0 ] && n=$((n + 1)); done; printf 'service-%02d.log %d\n' "$i" "$n"; done)
[ "$(cat report.txt)" = "$expected" ]
