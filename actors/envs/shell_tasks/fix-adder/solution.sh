cat add.sh
printf '#!/bin/bash\necho $(( $1 + $2 ))\n' > add.sh
