for v in "stall PUT uploadId 2" "lose_answer POST uploadId 1" "act_then_stall POST uploadId 1" "reset PUT uploadId 3"; do
  f="out_sc1big_$(echo $v | tr ' ./' '___').txt"
  BIG=1048576 timeout 900 nice -n 10 /tmp/review96/.venv/bin/python sc1_drain_faults.py $v > $f 2>&1; echo rc=$? >> $f
done
