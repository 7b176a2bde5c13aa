ls exams
cat exams/ada
cat exams/ben
cat exams/cleo
cat exams/dan
cat exams/eve
cat exams/finn
cat exams/gus
cat exams/hana
cat exams/ivo
cat exams/jo
for f in exams/*; do awk -v n="$(basename "$f")" '{s += $1} END {if (s / NR >= 60) print n}' "$f"; done | sort > passed.txt
cat passed.txt
