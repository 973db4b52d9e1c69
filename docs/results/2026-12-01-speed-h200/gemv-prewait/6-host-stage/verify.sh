set -u
mkdir -p /root/stash $OUT && tar xzf .cache/carry/ab.tgz -C /root/stash --strip-components=1
timeout 110 bash scripts/gpu/speed.sh checkpoints > $OUT/ckpt.txt 2>&1
tail -1 $OUT/ckpt.txt
timeout 40 /root/stash/met_f check-kernels --kernel gemv > $OUT/check-gemv-met_f.txt 2>&1; echo "check rc=$? $(tail -1 $OUT/check-gemv-met_f.txt)"
p=$(python3 -c "print(' '.join(['hello'] * 31))")
for m in qwen3-8b qwen3-0.6b; do for b in met_f met; do
timeout 40 /root/stash/$b generate --backend cuda --model-from-path /root/ckpt/$m --prompt "$p" --max-tokens 256 --temperature 0 --ignore-eos --max-seq-len 1024 --warm-up --print-ids > $OUT/gen-$m-$b.txt 2>&1
echo "$b $m $(grep -o 'decode [0-9.]* tok/s' $OUT/gen-$m-$b.txt) ids $(grep '^output ids:' $OUT/gen-$m-$b.txt | md5sum | cut -c1-8)"
done; done
