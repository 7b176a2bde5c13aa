[ "$(tr -d ' \n' < count.txt)" = "37" ]
