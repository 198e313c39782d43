#!/bin/bash
# Carry Triton's compile cache between device calls: a fresh machine spends minutes compiling
# the engine's kernels before its first number (session 8: 2-4 min of a 30 min budget each).
#
#   start of a call:  source benchmarks/triton_cache.sh restore
#                     (unpacks .cache/triton_parts if present; sets TRITON_CACHE_DIR)
#   end of a call:    bash benchmarks/triton_cache.sh save "$OUT"
#                     ($OUT/triton_cache.tgz.part-aa, -ab, ...: $OUT gives back files of at
#                     most 16 MiB, eight in all; the cache was ~19 MB gzipped)
#   here, after it:   bash benchmarks/triton_cache.sh collect /work/.device/N
#                     (-> .cache/triton_parts, ignored by git: name it in the next call's carry)
# Entries are keyed by each kernel's source and the Triton version, so an edited kernel just
# compiles again. `save` keeps only the entries this call looked up (restore logs them:
# triton_cache_log.py), so stale versions of edited kernels drop out; a call that ran only
# part of the engine therefore saves only that part: collect the cache of a call that ran
# the whole benchmark.
cache_command=${1:?usage: triton_cache.sh save OUT | collect DIR | restore}
case $cache_command in
save)
  out=${2:?save needs the OUT folder}
  if [ -s .cache/triton_used.log ]; then
    sort -u .cache/triton_used.log | while read -r key; do
      [ -d ".cache/triton/$key" ] && echo "triton/$key"
    done > .cache/triton_keep.txt
    tar czf - -C .cache -T .cache/triton_keep.txt | split -b 15M - "$out/triton_cache.tgz.part-"
  else
    tar czf - -C .cache triton | split -b 15M - "$out/triton_cache.tgz.part-"
  fi
  ;;
collect)
  rm -rf .cache/triton_parts && mkdir -p .cache/triton_parts
  cp "${2:?collect needs the folder the call files came back in}"/triton_cache.tgz.part-* .cache/triton_parts/
  ;;
restore)
  mkdir -p .cache
  if compgen -G ".cache/triton_parts/triton_cache.tgz.part-*" > /dev/null; then
    cat .cache/triton_parts/triton_cache.tgz.part-* | tar xzf - -C .cache
  fi
  export TRITON_CACHE_DIR=$PWD/.cache/triton
  rm -f .cache/triton_used.log
  export TRITON_CACHE_LOG=$PWD/.cache/triton_used.log
  export TRITON_CACHE_MANAGER=triton_cache_log:LoggingCacheManager
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # benchmarks/, for triton_cache_log.py
  export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
  ;;
*)
  echo "triton_cache.sh: unknown command $cache_command (save | collect | restore)" >&2
  return 2 2> /dev/null || exit 2
  ;;
esac
