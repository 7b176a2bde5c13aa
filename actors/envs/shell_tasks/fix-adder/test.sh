[ "$(bash add.sh 2 3)" = "5" ] && [ "$(bash add.sh 40 2)" = "42" ]
