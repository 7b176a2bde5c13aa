[ "$(tr -d ' \n' < answer.txt)" = "note-13.txt" ]
