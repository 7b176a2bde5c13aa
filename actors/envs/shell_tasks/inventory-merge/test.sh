expected=$(for item in apple bread cheese dates eggs; do t=0; for s in $(seq 1 9); do [ $(((s + ${#item}) % 3)) = 0 ] || t=$((t + (s * ${#item}) % 9 + 1)); done; echo "$item $t"; done)
[ "$(cat inventory.txt)" = "$expected" ]
