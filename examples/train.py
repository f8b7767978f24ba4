"""A tiny training job for the demo: fits y = 3x + 2 by gradient descent, pure Python.

It behaves like a real training script under ma-run: hyperparameters arrive as
`--name=value` arguments, progress goes to stdout, a checkpoint is written on
SIGTERM (the platform's stop), and the result lands in --train_url.
"""

import argparse
import json
import os
import random
import signal
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_url", help="directory holding points.csv (staged in by ma-run)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--train_url", default=os.path.join(os.environ.get("MA_MOUNT_PATH", "."), "outputs"))
    parser.add_argument("--step_seconds", type=float, default=0.05)
    args, unknown = parser.parse_known_args()  # the platform may append more than we know
    return args


def load_data(data_url):
    """points.csv from the staged input, or the same synthetic points when run alone."""
    if not data_url:
        return make_data()
    with open(os.path.join(data_url, "points.csv")) as f:
        next(f)  # header
        return [tuple(map(float, line.split(","))) for line in f if line.strip()]


def make_data(count=64, seed=0):
    rng = random.Random(seed)
    xs = [rng.uniform(-1, 1) for _ in range(count)]
    return [(x, 3 * x + 2 + rng.gauss(0, 0.01)) for x in xs]


def save(path, model):
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, ".model.json.tmp")
    with open(tmp, "w") as f:
        json.dump(model, f)
    os.replace(tmp, os.path.join(path, "model.json"))


def main():
    args = parse_args()
    data = load_data(args.data_url)
    model = {"w": 0.0, "b": 0.0, "epoch": 0}

    def on_sigterm(_signum, _frame):
        save(args.train_url, model)
        print(f"SIGTERM: checkpoint saved at epoch {model['epoch']}", flush=True)
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"start: attempt {os.environ.get('MA_PROC_START_CNT', '1')}, lr={args.lr}, epochs={args.epochs}, "
          f"{len(data)} points from {args.data_url or 'memory'}", flush=True)
    for epoch in range(1, args.epochs + 1):
        grad_w = sum(2 * (model["w"] * x + model["b"] - y) * x for x, y in data) / len(data)
        grad_b = sum(2 * (model["w"] * x + model["b"] - y) for x, y in data) / len(data)
        model["w"] -= args.lr * 10 * grad_w
        model["b"] -= args.lr * 10 * grad_b
        model["epoch"] = epoch
        loss = sum((model["w"] * x + model["b"] - y) ** 2 for x, y in data) / len(data)
        print(f"epoch {epoch:3d}  loss {loss:.6f}", flush=True)
        time.sleep(args.step_seconds)
    save(args.train_url, model)
    print(f"final: w={model['w']:.3f} b={model['b']:.3f} (true: w=3 b=2); model saved to {args.train_url}/model.json")


if __name__ == "__main__":
    main()
