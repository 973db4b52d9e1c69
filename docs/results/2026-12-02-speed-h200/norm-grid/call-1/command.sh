set -u
mkdir -p /root/stash && tar xzf .cache/carry/ab.tgz -C /root/stash
L=METRALE_CARVEOUT_LABELS G=METRALE_GRID_CAP_LABELS
SPEED_MODELS="qwen3-8b qwen3-0.6b" timeout 140 bash scripts/gpu/speed.sh checkpoints > $OUT/ckpt.log 2>&1; tail -3 $OUT/ckpt.log
SPEED_MODELS=qwen3-0.6b TL_VARIANTS="base gq132:$G=qkv=132 gq264:$G=qkv=264 go264:$G=o=264 ggu264:$G=gate_up=264 gd264:$G=down=264 gall264:$G=qkv=264+o=264+gate_up=264+down=264 cqod:$L=qkv=100+o=100+down=100 cqoa:$L=qkv=100+o=100+attention=100" timeout 130 bash scripts/gpu/speed.sh timelines > $OUT/tl06.log 2>&1
SPEED_MODELS=qwen3-8b TL_VARIANTS="base stall:METRALE_GEMV_STAGE=all norm:METRALE_GEMV_NORM=all norm50:METRALE_GEMV_NORM=all,$L=qkv=100+gate_up=50 normst:METRALE_GEMV_NORM=all,METRALE_GEMV_STAGE=all gq132:$G=qkv=132 go264:$G=o=264 ggu264:$G=gate_up=264" timeout 130 bash scripts/gpu/speed.sh timelines > $OUT/tl8.log 2>&1
RES=/root/results-ab AB="met met_p" AB_KERNEL=gemv AB_SHAPE=qwen3-0.6b AB_ROWS=lm_head AB_MODEL_RUNS="8b-short" AB_PARITY=0 AB_REPEAT=2 timeout 185 bash scripts/gpu/speed.sh ab > $OUT/ab.log 2>&1
tail -5 $OUT/tl06.log; tail -5 $OUT/tl8.log; tail -40 $OUT/ab.log
