expected=$(for name in ada ben cleo dan eve finn gus hana ivo jo; do n=${#name}; s=0; for k in 1 2 3 4; do s=$((s + (n * 23 + k * 17 + ${#name} * k * 5) % 61 + 30)); done; [ $((s * 10 / 4)) -ge 600 ] && echo "$name"; done | sort)
[ "$(cat passed.txt 2>/dev/null)" = "$expected" ]
