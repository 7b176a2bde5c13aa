mkdir exams
for name in ada ben cleo dan eve finn gus hana ivo jo; do
  n=${#name}
  for k in 1 2 3 4; do echo $(((n * 23 + k * 17 + ${#name} * k * 5) % 61 + 30)); done > "exams/$name"
done
