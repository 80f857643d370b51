"""ImageNet training written after pytorch/examples' imagenet/main.py (its training loop in 109 lines, not the
whole script), loading with coordl.

The line that makes it coordl's is the train loader's: ``coordl.DataLoader`` instead of
``torch.utils.data.DataLoader``. Run:

    python examples/train_imagenet.py /path/to/imagenet --arch resnet18 --epochs 90 --workers 8
    torchrun --nproc-per-node 8 examples/train_imagenet.py /path/to/imagenet --arch resnet50
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data
import torchvision
from torchvision import transforms as T

import coordl


def parse_args():
    p = argparse.ArgumentParser(description="ImageNet training")
    p.add_argument("data", help="folder with train/ and val/ in ImageFolder layout")
    p.add_argument("--arch", default="resnet18", choices=sorted(n for n in torchvision.models.list_models(
        module=torchvision.models)))
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256, help="per process")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--print-freq", type=int, default=100)
    return p.parse_args()


def main():
    args = parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    model = torchvision.models.get_model(args.arch).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)

    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize]))
    val_dataset = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"), T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize]))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset) if distributed else None

    train_loader = coordl.DataLoader(  # the one changed line: was torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None), num_workers=args.workers,
        pin_memory=True, sampler=train_sampler)
    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers, pin_memory=True)

    for epoch in range(args.epochs):
        if distributed:
            train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, device, args)
        acc1 = validate(val_loader, model, device)
        scheduler.step()
        if not distributed or dist.get_rank() == 0:
            print(f"epoch {epoch}: val acc@1 {acc1:.2f}")


def train(loader, model, criterion, optimizer, epoch, device, args):
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(loader):
        data_time = time.time() - end
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % args.print_freq == 0:
            print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.4f} data {data_time:.3f}s "
                  f"batch {time.time() - end:.3f}s")
        end = time.time()


@torch.no_grad()
def validate(loader, model, device):
    model.eval()
    correct = total = 0
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        correct += (model(images).argmax(dim=1) == target).sum().item()
        total += target.numel()
    return 100.0 * correct / max(total, 1)


if __name__ == "__main__":
    main()
