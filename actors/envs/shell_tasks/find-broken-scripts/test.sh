[ "$(cat broken.txt)" = "$(printf 'job-3.sh\njob-6.sh\njob-7.sh\njob-9.sh')" ]
