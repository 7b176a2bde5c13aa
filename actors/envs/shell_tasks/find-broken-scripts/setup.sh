mkdir bin
for i in $(seq 1 10); do
  if [ $((i % 3)) = 0 ] || [ "$i" = 7 ]; then
    printf 'echo step %d\nfalse\n' "$i" > "bin/job-$i.sh"
  else
    printf 'echo step %d\ntrue\n' "$i" > "bin/job-$i.sh"
  fi
done
