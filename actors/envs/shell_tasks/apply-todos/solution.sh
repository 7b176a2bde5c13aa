ls src
head -1 src/part-1.txt
t=$(head -1 src/part-1.txt); o=$(echo "$t" | cut -d' ' -f3); n=$(echo "$t" | cut -d' ' -f5); sed -i -e '1d' -e "s/$o/$n/g" src/part-1.txt
head -1 src/part-2.txt
t=$(head -1 src/part-2.txt); o=$(echo "$t" | cut -d' ' -f3); n=$(echo "$t" | cut -d' ' -f5); sed -i -e '1d' -e "s/$o/$n/g" src/part-2.txt
head -1 src/part-3.txt
t=$(head -1 src/part-3.txt); o=$(echo "$t" | cut -d' ' -f3); n=$(echo "$t" | cut -d' ' -f5); sed -i -e '1d' -e "s/$o/$n/g" src/part-3.txt
head -1 src/part-4.txt
t=$(head -1 src/part-4.txt); o=$(echo "$t" | cut -d' ' -f3); n=$(echo "$t" | cut -d' ' -f5); sed -i -e '1d' -e "s/$o/$n/g" src/part-4.txt
head -1 src/part-5.txt
t=$(head -1 src/part-5.txt); o=$(echo "$t" | cut -d' ' -f3); n=$(echo "$t" | cut -d' ' -f5); sed -i -e '1d' -e "s/$o/$n/g" src/part-5.txt
head -1 src/part-6.txt
t=$(head -1 src/part-6.txt); o=$(echo "$t" | cut -d' ' -f3); n=$(echo "$t" | cut -d' ' -f5); sed -i -e '1d' -e "s/$o/$n/g" src/part-6.txt
head -1 src/part-7.txt
t=$(head -1 src/part-7.txt); o=$(echo "$t" | cut -d' ' -f3); n=$(echo "$t" | cut -d' ' -f5); sed -i -e '1d' -e "s/$o/$n/g" src/part-7.txt
head -1 src/part-8.txt
t=$(head -1 src/part-8.txt); o=$(echo "$t" | cut -d' ' -f3); n=$(echo "$t" | cut -d' ' -f5); sed -i -e '1d' -e "s/$o/$n/g" src/part-8.txt
cat src/part-1.txt
