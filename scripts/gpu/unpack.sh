# Sourced by run.sh and first_minutes.sh on the GPU machine: unpacks the gzipped binaries of
# $dir/bin into a temporary folder, sets `bin` to it, and prints the GPU.
bin="$(mktemp -d)"
for packed in "$dir"/bin/*.gz; do
  name=$(basename "$packed" .gz)
  gzip -dc "$packed" >"$bin/$name" && chmod +x "$bin/$name"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
