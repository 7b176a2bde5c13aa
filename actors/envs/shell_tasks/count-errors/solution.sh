ls logs
grep -c ERROR logs/service-01.log
grep -c ERROR logs/service-02.log
grep -c ERROR logs/service-03.log
grep -c ERROR logs/service-04.log
grep -c ERROR logs/service-05.log
grep -c ERROR logs/service-06.log
grep -c ERROR logs/service-07.log
grep -c ERROR logs/service-08.log
grep -c ERROR logs/service-09.log
grep -c ERROR logs/service-10.log
for f in logs/*.log; do echo "$(basename "$f") $(grep -c ERROR "$f")"; done > report.txt
cat report.txt
