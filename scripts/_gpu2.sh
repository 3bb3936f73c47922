source .gl/preamble.sh
python3 -c "
from vkgraph.runtime import get_device
i=get_device().info; print(i.integer_dot_product, i.integer_dot_product_accelerated, i.subgroup_size)" > $OUT/info.txt 2>&1
cd benchmarks
timeout -s KILL 170 python3 tune_matvec.py --formats Q4_0 --batches 1,2,4,8 --paths int8 --reps 10 > $OUT/tune_q4.txt 2>&1
timeout -s KILL 130 python3 tune_matvec.py --formats Q8_0 --batches 1,4,8 --paths int8 --reps 10 > $OUT/tune_q8.txt 2>&1
VKGRAPH_PROFILE=1 timeout -s KILL 110 python3 bench_tensor.py --gpu > $OUT/tensor.txt 2>&1
VKGRAPH_INT_DOT=1 timeout -s KILL 150 python3 bench_llm.py --formats Q4_0 --batches 1,8,32 --steps 10 --prompt 256 --no-peers > $OUT/llm.txt 2>&1
cat $OUT/info.txt; tail -5 $OUT/llm.txt
