source .gl/preamble.sh
cd benchmarks
timeout -s KILL 100 python3 profile_decode.py --format Q4_0 --steps 3 > $OUT/profile_int8.txt 2>&1
tail -25 $OUT/profile_int8.txt
timeout -s KILL 170 python3 bench_kernels.py > $OUT/bench_kernels.txt 2>&1
timeout -s KILL 120 python3 bench_llm.py --formats Q4_0 --batches 1,8,32 --steps 10 --prompt 256 --no-peers > $OUT/llm.txt 2>&1
VKGRAPH_PROFILE=1 timeout -s KILL 120 python3 bench_tensor.py --gpu > $OUT/tensor.txt 2>&1
