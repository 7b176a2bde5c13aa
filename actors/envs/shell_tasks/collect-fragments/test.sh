[ "$(tr -d ' \n' < secret.txt)" = "planetaryorbitscalmlyandquietly" ]
