ls stores
cat stores/store-1.txt
cat stores/store-2.txt
cat stores/store-3.txt
cat stores/store-4.txt
cat stores/store-5.txt
cat stores/store-6.txt
cat stores/store-7.txt
cat stores/store-8.txt
cat stores/store-9.txt
cat stores/*.txt | awk '{t[$1] += $2} END {for (i in t) print i, t[i]}' | sort > inventory.txt
cat inventory.txt
