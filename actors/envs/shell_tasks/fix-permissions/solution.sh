cat manifest.txt
ls -l tools
grep -qx tool-1 manifest.txt && chmod +x tools/tool-1 || chmod -x tools/tool-1
grep -qx tool-2 manifest.txt && chmod +x tools/tool-2 || chmod -x tools/tool-2
grep -qx tool-3 manifest.txt && chmod +x tools/tool-3 || chmod -x tools/tool-3
grep -qx tool-4 manifest.txt && chmod +x tools/tool-4 || chmod -x tools/tool-4
grep -qx tool-5 manifest.txt && chmod +x tools/tool-5 || chmod -x tools/tool-5
grep -qx tool-6 manifest.txt && chmod +x tools/tool-6 || chmod -x tools/tool-6
grep -qx tool-7 manifest.txt && chmod +x tools/tool-7 || chmod -x tools/tool-7
grep -qx tool-8 manifest.txt && chmod +x tools/tool-8 || chmod -x tools/tool-8
grep -qx tool-9 manifest.txt && chmod +x tools/tool-9 || chmod -x tools/tool-9
grep -qx tool-10 manifest.txt && chmod +x tools/tool-10 || chmod -x tools/tool-10
ls -l tools
