find vault -type f
cat vault/zone-0/shelf-1/box-5.txt
cat vault/zone-0/shelf-2/box-10.txt
cat vault/zone-0/shelf-3/box-15.txt
cat vault/zone-1/empty-1.txt
cat vault/zone-1/shelf-0/box-11.txt
cat vault/zone-1/shelf-2/box-13.txt
cat vault/zone-1/shelf-3/box-1.txt
cat vault/zone-1/shelf-4/box-6.txt
cat vault/zone-2/empty-2.txt
cat vault/zone-2/shelf-0/box-14.txt
cat vault/zone-2/shelf-1/box-2.txt
cat vault/zone-2/shelf-4/box-9.txt
cat vault/zone-3/empty-3.txt
grep -rh '^fragment' vault | sort -t' ' -k2 -n | sed 's/.*: //' | tr -d '\n' > secret.txt
cat secret.txt
