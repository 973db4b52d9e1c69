set -u
mkdir -p /root/stash && tar xzf .cache/carry/ab.tgz -C /root/stash
SPEED_MODELS="qwen3-8b qwen3-0.6b" timeout 200 bash scripts/gpu/speed.sh checkpoints > $OUT/ckpt.log 2>&1; tail -1 $OUT/ckpt.log
rm -rf /root/results-ab; mkdir -p /root/results-ab
W=METRALE_ATTENTION_WIDE_BLOCKS
RES=/root/results-ab AB="met met:$W=0" AB_KERNEL=attention AB_SHAPE=qwen3-8b AB_ROWS="decode attention seqs=1 context=(160|256)" AB_MODEL_RUNS="8b-short" AB_PARITY=0 AB_REPEAT=2 timeout 300 bash scripts/gpu/speed.sh ab > $OUT/ab.log 2>&1
echo "ab exit $?"; tar czf $OUT/ab-raw.tgz -C /root/results-ab .
rm -rf /root/results-speed; mkdir -p /root/results-speed
TL_VARIANTS="w n:$W=0" timeout 150 bash scripts/gpu/speed.sh timelines > /root/tl.txt 2>&1
cp /root/tl.txt /root/results-speed/; tar czf $OUT/tl-raw.tgz -C /root/results-speed .
tail -32 $OUT/ab.log; grep -E "^\| (attention|qkv|o |decode step)" /root/results-speed/timeline-*.md | head -30; head -30 /root/results-speed/timelines-*.md
