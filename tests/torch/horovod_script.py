"""A training script written for Horovod (horovod/examples/pytorch/pytorch_mnist.py, on the
digits data set): tests/torch/test_torch_examples.py changes its import line only and runs it
with ``pslink launch``. Nothing below knows about pslink."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits

import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--uneven", action="store_true", default=False, help="rank r skips r batches per epoch, then joins")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = x.view(-1, 8 * 4 * 4)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def datasets():
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    y = torch.tensor(y, dtype=torch.int64)
    cut = int(0.8 * len(x))
    return (torch.utils.data.TensorDataset(x[:cut], y[:cut]), torch.utils.data.TensorDataset(x[cut:], y[cut:]))


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    batches = len(train_loader) - (hvd.rank() if args.uneven else 0)
    for batch_idx, (data, target) in enumerate(train_loader):
        if batch_idx == batches:
            break
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
    if args.uneven:
        last = hvd.join()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: rank {last} joined last")
    if hvd.rank() == 0:
        print(f"Train Epoch: {epoch} loss {loss.item():.6f}")


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    test_loss = 0.0
    test_accuracy = 0.0
    for data, target in test_loader:
        output = model(data)
        test_loss += F.nll_loss(output, target, reduction="sum").item()
        pred = output.data.max(1, keepdim=True)[1]
        test_accuracy += pred.eq(target.data.view_as(pred)).float().sum().item()
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%")
    return test_accuracy


if __name__ == "__main__":
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset, test_dataset = datasets()
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                    rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                                   rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.batch_size, sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        accuracy = test()
    config = hvd.broadcast_object({"epochs": args.epochs} if hvd.rank() == 0 else None, root_rank=0)
    ranks = hvd.allgather(torch.tensor([hvd.rank()]))
    print(f"rank {hvd.rank()} of {hvd.size()}: accuracy {accuracy:.4f} config {config} ranks {ranks.tolist()}")
