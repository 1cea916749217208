export NCCL_NVLS_ENABLE=0 CXX=/usr/bin/g++ CC=/usr/bin/gcc
NG=$(nvidia-smi -L | wc -l); echo "GPUs: $NG"
rm -rf build; python3 -m pip install --no-build-isolation --no-deps -q . > $OUT/build.log 2>&1 || { tail -50 $OUT/build.log; exit 1; }
timeout 150 python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_fsdp_gpu.py > $OUT/fsdp_tests.log 2>&1; tail -30 $OUT/fsdp_tests.log | cut -c1-400
timeout 100 meshcoll-run -n 2 bench/python/fsdp_vs_torch.py --steps 10 --warmup 2 > $OUT/fsdp2.log 2>&1; tail -14 $OUT/fsdp2.log | cut -c1-300
[ $NG -ge 4 ] && { timeout 100 meshcoll-run -n 4 bench/python/fsdp_vs_torch.py --steps 10 --warmup 2 > $OUT/fsdp4.log 2>&1; tail -14 $OUT/fsdp4.log | cut -c1-300; }
