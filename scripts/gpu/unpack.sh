# Sourced by run.sh and first_minutes.sh on the GPU machine: unpacks the xz-packed binaries of
# $dir/bin into a temporary folder, sets `bin` to it, and prints the GPU. Python's lzma stands
# in for xz where the machine has none (PyTorch's images always have Python).
bin="$(mktemp -d)"
for packed in "$dir"/bin/*.xz; do
  name=$(basename "$packed" .xz)
  if command -v xz >/dev/null; then
    xz -dc "$packed" >"$bin/$name"
  else
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$packed" "$bin/$name"
  fi
  chmod +x "$bin/$name"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
