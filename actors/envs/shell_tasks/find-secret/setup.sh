mkdir notes
for i in $(seq 1 20); do echo "plain note number $i" > "notes/note-$i.txt"; done
echo "the secret is here" >> notes/note-13.txt
