[ "$(cat hello.txt)" = "hello world" ]
