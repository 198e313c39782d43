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
# compiles again.
cache_command=${1:?usage: triton_cache.sh save OUT | collect DIR | restore}
case $cache_command in
save)
  tar czf - -C .cache triton | split -b 15M - "${2:?save needs the OUT folder}/triton_cache.tgz.part-"
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
  ;;
*)
  echo "triton_cache.sh: unknown command $cache_command (save | collect | restore)" >&2
  return 2 2> /dev/null || exit 2
  ;;
esac
