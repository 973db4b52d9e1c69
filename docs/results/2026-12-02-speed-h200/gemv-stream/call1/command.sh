set -u
mkdir -p /root/stash && tar xzf .cache/carry/ab.tgz -C /root/stash && /root/stash/met --version
SPEED_MODELS="qwen3-8b" timeout 150 bash scripts/gpu/speed.sh checkpoints > $OUT/ckpt.log 2>&1; tail -1 $OUT/ckpt.log
M=/root/stash/met
timeout 60 $M check-kernels --kernel gemv_bf16_stream > $OUT/check-stream.txt 2>&1; echo "check stream exit $?: $(tail -1 $OUT/check-stream.txt)"
timeout 150 $M check-kernels --seed 1796208326377630473 > $OUT/check-pinned.txt 2>&1; echo "check pinned exit $?: $(tail -1 $OUT/check-pinned.txt)"
grep -B2 -A4 FAIL $OUT/check-stream.txt $OUT/check-pinned.txt | head -30
rm -rf /root/results-ab; mkdir -p /root/results-ab
S=METRALE_GEMV_STREAM_LABELS
RES=/root/results-ab AB="met met:$S=down met:$S=down+o+qkv+gate_up met:$S=down+o+qkv+gate_up,METRALE_EMBEDDING_VEC=1" AB_KERNEL=" " AB_SHAPE=qwen3-8b AB_ROWS="(qkv_proj|o_proj|down|gate_up[^ ]*) m=1 " AB_MODEL_RUNS="8b-short" AB_GENERATE=qwen3-8b AB_PARITY=0 AB_REPEAT=2 timeout 330 bash scripts/gpu/speed.sh ab > $OUT/ab.log 2>&1
echo "ab exit $?"; tar czf $OUT/ab-raw.tgz -C /root/results-ab .
if [ -x /root/stash/met_t ]; then
rm -rf /root/results-speed; mkdir -p /root/results-speed
SPEED_MODELS=qwen3-8b TL_VARIANTS="base s:$S=down+o+qkv+gate_up" timeout 100 bash scripts/gpu/speed.sh timelines > /root/tl.txt 2>&1
cp /root/tl.txt /root/results-speed/; tar czf $OUT/tl-raw.tgz -C /root/results-speed .
fi
tail -40 $OUT/ab.log; head -16 /root/results-speed/timelines-*.md 2>/dev/null
