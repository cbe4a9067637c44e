#!/usr/bin/env bash
# Re-split the Transformer Engine wheel that ../shared/gpu/te/pack-te.sh wrote into .te/ (five
# ~60 MiB parts) into N parts small enough to travel beside the working tree: a device call carries
# at most 64 MiB in all, and the tracked tree is ~16 MiB, so a 60 MiB part no longer fits (session
# 30). Rewrites .te/install-te.sh (git-ignored, a local copy) to join part0 .. part(N-1).
#   bash ../shared/gpu/te/pack-te.sh . && bash bench/te_resplit.sh [N]     # N = 7 by default
# Then: calls 1..N-1 carry .te/partK (`bash bench/te_device.sh part K`, K = 0..N-2), and the `run`
# call carries .te/part(N-1) with .te/whl, .te/te.sha256, .te/install-te.sh and the megatron-core wheel.
set -euo pipefail
n=${1:-7}
cd .te
name=$(awk '{print $2}' te.sha256)
tmp=$(mktemp -d)
cat $(ls part* | sort -V) > "$tmp/$name"
(cd "$tmp" && sha256sum -c "$OLDPWD/te.sha256") || { echo "error: .te/part* do not make the wheel"; exit 2; }
rm -f part*
split -n "$n" -d -a 1 "$tmp/$name" part
rm -rf "$tmp"
parts=$(seq -f 'part%g' 0 $((n - 1)) | tr '\n' ' ')
chmod u+w install-te.sh
sed -i -E "s/^cat part[0-9 part]+> \"\\\$name\"/cat ${parts}> \"\$name\"/" install-te.sh
grep -q "^cat ${parts}> \"\$name\"" install-te.sh || { echo "error: could not rewrite install-te.sh's cat line"; exit 2; }
ls -la part*
