set -e
cd "$(dirname "$0")/../../.."   # the repository root
COMMON="--preset tiny --steps 20 --log-every 1 --eval-every 100 --eval-batches 1 --warmup-steps 0 --batch-size 8 --no-progress --set a2a=direct --set schedule=sequential --set pipeline_degree=1 --set capacity_factor=null"
for rep in 0 1 2; do
  moeflow cluster run --nodes 2 --ranks-per-node 2 --inter-bw 1gbit -- python -m moeflow.cli train $COMMON --out runs/hecate-train/ep-$rep
  moeflow cluster run --nodes 2 --ranks-per-node 2 --inter-bw 1gbit -- python -m moeflow.cli train $COMMON --set placement=fssdp --set 'fssdp={"materialize":"sparse","overlap_degree":2,"memory_capacity":2,"reshard_every":10}' --out runs/hecate-train/fs-$rep
done
