ls bin
bash bin/job-1.sh; echo status $?
bash bin/job-2.sh; echo status $?
bash bin/job-3.sh; echo status $?
bash bin/job-4.sh; echo status $?
bash bin/job-5.sh; echo status $?
bash bin/job-6.sh; echo status $?
bash bin/job-7.sh; echo status $?
bash bin/job-8.sh; echo status $?
bash bin/job-9.sh; echo status $?
bash bin/job-10.sh; echo status $?
for f in bin/*.sh; do bash "$f" > /dev/null || basename "$f"; done | sort > broken.txt
cat broken.txt
