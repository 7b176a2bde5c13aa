ls ledgers
grep total ledgers/ledger-01.txt
grep total ledgers/ledger-02.txt
grep total ledgers/ledger-03.txt
grep total ledgers/ledger-04.txt
grep total ledgers/ledger-05.txt
grep total ledgers/ledger-06.txt
grep total ledgers/ledger-07.txt
grep total ledgers/ledger-08.txt
grep total ledgers/ledger-09.txt
grep total ledgers/ledger-10.txt
grep total ledgers/ledger-11.txt
grep total ledgers/ledger-12.txt
grep -h total ledgers/*.txt | awk '{s += $2} END {print s}' > total.txt
cat total.txt
