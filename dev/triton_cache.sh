#!/bin/bash
# Carry Triton's compile cache between jobs on fresh GPU machines: a fresh machine spends
# 2-4 minutes compiling the engine's kernels before its first number.
#
#   start of a job:   source dev/triton_cache.sh restore
#                     (unpacks .cache/triton_parts if present; sets TRITON_CACHE_DIR)
#   end of a job:     bash dev/triton_cache.sh save "$OUT"
#                     ($OUT/triton_cache.txz.part-aa, -ab, ...: 15 MiB pieces of an xz tar,
#                     .tgz without xz, for a job runner that returns small files only)
#   after it, here:   bash dev/triton_cache.sh collect DIR_THE_FILES_CAME_BACK_IN
#                     (-> .cache/triton_parts, ignored by git: ship it with the next job)
# Entries are keyed by each kernel's source and the Triton version, so an edited kernel just
# compiles again. `save` keeps only the entries this job looked up (restore logs them:
# triton_cache_log.py), so stale versions of edited kernels drop out; a job that ran only
# part of the engine therefore saves only that part: collect the cache of a job that ran
# the whole benchmark.
cache_command=${1:?usage: triton_cache.sh save OUT | collect DIR | restore}
case $cache_command in
save)
  out=${2:?save needs the OUT folder}
  if [ -s .cache/triton_used.log ]; then
    sort -u .cache/triton_used.log | while read -r key; do
      [ -d ".cache/triton/$key" ] && echo "triton/$key"
    done > .cache/triton_keep.txt
  else
    echo triton > .cache/triton_keep.txt
  fi
  # xz where the machine has it: the whole engine's kernels took 60 MB gzipped (more than a
  # job returns) and 26 MB as xz; gzip otherwise
  if command -v xz > /dev/null; then
    tar cf - -C .cache -T .cache/triton_keep.txt | xz -T0 -6 | split -b 15M - "$out/triton_cache.txz.part-"
  else
    tar czf - -C .cache -T .cache/triton_keep.txt | split -b 15M - "$out/triton_cache.tgz.part-"
  fi
  ;;
collect)
  rm -rf .cache/triton_parts && mkdir -p .cache/triton_parts
  cp "${2:?collect needs the folder the call files came back in}"/triton_cache.t?z.part-* .cache/triton_parts/
  ;;
restore)
  mkdir -p .cache
  if compgen -G ".cache/triton_parts/triton_cache.txz.part-*" > /dev/null; then
    cat .cache/triton_parts/triton_cache.txz.part-* | xz -dc | tar xf - -C .cache
  elif compgen -G ".cache/triton_parts/triton_cache.tgz.part-*" > /dev/null; then
    cat .cache/triton_parts/triton_cache.tgz.part-* | tar xzf - -C .cache
  fi
  export TRITON_CACHE_DIR=$PWD/.cache/triton
  rm -f .cache/triton_used.log
  export TRITON_CACHE_LOG=$PWD/.cache/triton_used.log
  export TRITON_CACHE_MANAGER=triton_cache_log:LoggingCacheManager
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # dev/, for triton_cache_log.py
  export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
  ;;
*)
  echo "triton_cache.sh: unknown command $cache_command (save | collect | restore)" >&2
  return 2 2> /dev/null || exit 2
  ;;
esac
