echo "hello world" > hello.txt
