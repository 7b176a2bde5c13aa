mkdir tools
for i in $(seq 1 10); do printf 'echo tool %d\n' "$i" > "tools/tool-$i"; done
chmod +x tools/tool-2 tools/tool-5 tools/tool-9
printf 'tool-1\ntool-4\ntool-5\ntool-8\n' > manifest.txt
