source .gl/preamble.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/smi.txt 2>&1
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -n 12 --timeout=50 --timeout-method=thread tests > $OUT/suite.txt 2>&1; echo rc=$? >> $OUT/suite.txt
tail -3 $OUT/suite.txt
cd benchmarks
timeout -s KILL 180 python3 bench_kernels.py > $OUT/bench_kernels.txt 2>&1; echo rc=$? >> $OUT/bench_kernels.txt
tail -40 $OUT/bench_kernels.txt
timeout -s KILL 200 python3 tune_matvec.py --formats Q4_0,Q8_0 --batches 1,8 > $OUT/tune.txt 2>&1; echo rc=$? >> $OUT/tune.txt
tail -40 $OUT/tune.txt
