ls inbox
head -1 inbox/item-1
mv inbox/item-1 inbox/$(head -1 inbox/item-1 | cut -d' ' -f2).txt
head -1 inbox/item-2
mv inbox/item-2 inbox/$(head -1 inbox/item-2 | cut -d' ' -f2).txt
head -1 inbox/item-3
mv inbox/item-3 inbox/$(head -1 inbox/item-3 | cut -d' ' -f2).txt
head -1 inbox/item-4
mv inbox/item-4 inbox/$(head -1 inbox/item-4 | cut -d' ' -f2).txt
head -1 inbox/item-5
mv inbox/item-5 inbox/$(head -1 inbox/item-5 | cut -d' ' -f2).txt
head -1 inbox/item-6
mv inbox/item-6 inbox/$(head -1 inbox/item-6 | cut -d' ' -f2).txt
head -1 inbox/item-7
mv inbox/item-7 inbox/$(head -1 inbox/item-7 | cut -d' ' -f2).txt
head -1 inbox/item-8
mv inbox/item-8 inbox/$(head -1 inbox/item-8 | cut -d' ' -f2).txt
head -1 inbox/item-9
mv inbox/item-9 inbox/$(head -1 inbox/item-9 | cut -d' ' -f2).txt
head -1 inbox/item-10
mv inbox/item-10 inbox/$(head -1 inbox/item-10 | cut -d' ' -f2).txt
ls inbox
