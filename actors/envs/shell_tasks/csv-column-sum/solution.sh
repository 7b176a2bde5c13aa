ls sales
cat sales/region-1.csv
cat sales/region-2.csv
cat sales/region-3.csv
cat sales/region-4.csv
cat sales/region-5.csv
cat sales/region-6.csv
cat sales/region-7.csv
cat sales/region-8.csv
for f in sales/*.csv; do awk -F, 'NR == 1 {for (c = 1; c <= NF; c++) if ($c == "amount") k = c; next} {print $k}' "$f"; done | awk '{s += $1} END {print s}' > total.txt
cat total.txt
